"""The data path built from the configuration: one part of the run, saved by the checkpoint as "data".

`TrainingBatches` reads the training shards in the loader's workers (`ShardStream`), decodes beside
them as `data.decoder` says (`resolve_data_path`), gathers each step's batch (`BatchStream`) and
keeps where the stream stands (`StreamState`) and its data-error counts; it shuts all of it down.
docs/architecture.md tells how a batch flows.

**A step's batch** is gathered on the host from the loader's pieces while the step runs.
`BatchStream` puts each piece, in a thread of the training process, into the batch's columns
(`ChunkSource`s: pinned uint8 images and token ids, or the images' bytes for a decoder), one batch
ahead; a chunk is handed to the step as soon as its pieces are in. A batch is a context: leaving it
after the step marks it used, which moves the stream's cursors past its pieces, and frees its
buffers for the batch after next.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple, Protocol

import torch

from clipscale.config import Config, ConfigError
from clipscale.data import prepare_data
from clipscale.data.chunks import (LOOKAHEAD, Arrivals, ChunkSource, DeviceTransform, KeepBudget, PinnedRows,
                                   PulledArrivals, WorkerArenas, aligned, arenas_page_locked, on_the_callers_device,
                                   paged, pinned_empty, spill_directory, spill_room)
from clipscale.data.decoders import DECODE_THREADS, DecodePool, DeviceDecoder
from clipscale.data.epoch import WorkList
from clipscale.data.shards import SKIPS_NAMED, ShardStream, StreamState
from clipscale.data.transforms import REGION_LIMIT, CaptionTokenizer, SplitTransform, uint8_image_bytes
from clipscale.distributed import World, all_reduce_sum_list
from clipscale.errors import UserError
from clipscale.signals import ignore_stop_signals
from clipscale.utilization import peak_bf16_flops
from clipscale.worker_server import worker_context

if TYPE_CHECKING:
    from clipscale.checks import RunPlan

@dataclass
class DataPath:
    """What the configuration resolves to on this machine, and the lines that say why."""

    decoder: str  # loader | device
    offload: bool
    notes: list[str]
    worker_decode_share: float = 0.0  # device: the share of the GPU's JPEGs the workers decode instead
    arenas: bool = False  # the workers decode every image into arenas (WorkerArenas): no data thread in the trainer
    arena_window: ArenaWindow | None = None  # device: what `arena_window` gives this rank's batch

    def describe(self) -> str:
        if self.arenas and self.worker_decode_share >= 1:
            return (f"training images decoded by the loader workers (libjpeg-turbo) into {arenas_memory()}, each chunk "
                    "resized on the GPU by the training thread")
        who = "the GPU (nvJPEG)" if self.decoder == "device" else "the loader workers (PIL)"
        who += " in the training thread" if self.arenas else ""
        if self.worker_decode_share:
            who += f", {self.worker_decode_share:.0%} of its JPEGs by the loader workers (libjpeg-turbo)"
            who += f" into {arenas_memory()}" if self.arenas else ""
        return f"training images decoded by {who}" + ("; the batch offloaded to the host as JPEG bytes" if self.offload else "")


def arenas_memory() -> str:
    return "page-locked shared memory" if arenas_page_locked() else "pageable shared memory (CLIPSCALE_PAGE_LOCK_ARENAS=0)"


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
ARENA_TOKENS_BYTES = 8192  # an arena's room a sample for its token ids and table rows (1,000 int64 tokens)
# The workers' arenas (share 1): at most this fraction of the host's memory a rank; the loader may
# run this many of a worker's batch shares ahead (they wait for room in their arena anyway).
ARENA_HOST_FRACTION, ARENA_BATCHES = 0.5, 2
# A rank's batch larger than its arenas can hold whole (every region at its largest) still takes
# share 1: the arenas hold a window of it, and pass 1 hands each chunk back to them as it goes
# (`WorkerArenas.holds_a_batch`). Pass 2's pixels then wait on the GPU (data.keep_on_device_gib) and,
# beyond it, on the host as final uint8 (`OnHost`): with the arenas at most STEP_HOST_FRACTION of the
# host a rank, the window getting what those pixels leave (up to the arenas' own room). Until
# 2026-11-29 the two had fixed shares (the arenas half, the pixels a quarter), so a million samples on
# one GPU had no window even where the GPU kept most of pass 2's pixels.
# A worker's window must hold its pieces that the trainer has taken and not yet handed back, those of
# HANDED_BACK_CHUNKS chunks (LOOKAHEAD being prepared, the one in use, two whose copies may still run;
# the loader hands the workers' pieces out in turn), and the next it writes, twice over.
STEP_HOST_FRACTION, HANDED_BACK_CHUNKS, HANDED_BACK_SPARE = 0.75, LOOKAHEAD + 3, 2
# The arenas are page-locked a segment at a time in the order the workers write them, so the first
# batch's copies need not wait for all of them: CUDA's other calls wait behind each registration
# (65 ms for this many bytes at the 4 GB/s an H200 host registered them), so not much smaller.
PAGE_LOCK_SEGMENT = 256 << 20


# data.worker_decode_share=auto is 1 (the workers decode every image into their arenas: no data
# thread in the trainer) where the workers decode faster than the towers train and their arenas fit
# the host: they decode about WORKER_IMAGES_PER_S each at share 1 (14 workers 10,949 images/s on a
# 16-core H200 host, libjpeg-turbo, the trainer's copy and resize of each chunk included:
# results/bench_loader_h200_workers_simplejpeg.json); the towers train at about TOWERS_MFU of the
# GPU's peak, counting the FLOPs the trainer hands over: those of a sample in the shortest text
# bucket, so the estimate runs ahead of the towers (ViT-B/32's ceiling on an H200: 6,431 samples/s
# against 7,770 estimated; at 0.27, ViT-B/16's ceiling mfu, ViT-B/32's 9,540 left it at 0.4 with
# 14 workers, which trained at 0.833 of its ceiling where share 1 gave 0.967). At 32,768 on an
# H200: ViT-B/16 0.977 of its ceiling at share 1, 0.937 at 0.4
# (results/bench_e2e_h200_b16_32k_arenas.json, ..._default_same_machine.json); ViT-B/32 0.894 at share 1
# (results/bench_e2e_h200_b32_32k_arenas_carry_pieces.json), 0.833 at 0.4 (..._work_ahead.json); at
# 65,536, 0.967 at share 1 (results/bench_e2e_h200_b32_65k_give_back.json).
WORKER_IMAGES_PER_S, TOWERS_MFU, KEEP_UP_MARGIN = 780, 0.22, 1.2


def towers_samples_per_s(flops_per_sample: int | None, device: torch.device) -> float | None:
    """About how many samples a second the towers train on `device` (None: no GPU peak known)."""
    peak = peak_bf16_flops(device) if flops_per_sample else None
    return peak * TOWERS_MFU / flops_per_sample if peak else None


def auto_worker_share(workers: int, per_rank_batch: int, image_bytes: int, host_bytes: int,
                      towers_per_s: float | None = None, arenas_fit: bool = False) -> tuple[float, str | None]:
    """data.worker_decode_share=auto for a rank: (the share, a note where the host's memory lowered
    it). 1 where the workers outpace the towers (`towers_per_s`: this rank's samples a second) and
    the arenas share 1 writes into fit (`arenas_fit`, `arena_window`); else the measured share, 0
    where its pixels would not fit the host."""
    keeps_up = towers_per_s is not None and workers * WORKER_IMAGES_PER_S >= KEEP_UP_MARGIN * towers_per_s
    if keeps_up and arenas_fit:
        return 1.0, None
    share = AUTO_SHARE * min(1.0, workers / AUTO_SHARE_WORKERS)
    held = BATCHES_HELD * per_rank_batch * share * image_bytes
    if held > AUTO_SHARE_HOST_FRACTION * host_bytes:
        return 0.0, (f"data.worker_decode_share=auto: 0, the GPU decodes every JPEG it can (at {share:.2f} the workers' "
                     f"pixels would hold {held / 2**30:.0f} GiB of the host's {host_bytes / 2**30:.0f} GiB a rank)")
    return share, None


def arena_sample_bytes(height: int, width: int) -> int:
    """The room a sample takes in the workers' arenas: its crop's region at its largest
    (`REGION_LIMIT` outputs' pixels: a piece's samples may all be large) and its tokens."""
    return int(REGION_LIMIT * uint8_image_bytes(height, width)) + ARENA_TOKENS_BYTES


def pieces_per_worker(per_rank_batch: int, piece: int, workers: int) -> int:
    """The most pieces of a rank's batch one loader worker gives (they take the pieces in turn)."""
    return -(-(per_rank_batch // piece) // max(1, workers))


class ArenaWindow(NamedTuple):
    """Each worker's arena at share 1 (`arena_window`): its bytes, the segments CUDA page-locks it
    in (`WorkerArenas`), and whether it holds the worker's pieces of a whole batch."""

    arena_bytes: int
    segment_bytes: int
    holds_a_batch: bool
    on_host_bytes: int = 0  # a window's: the pixels pass 2 needs beyond the device's keep, waiting on the host
    spilled_bytes: int = 0  # and beyond the host's room, waiting on disk (`SpillFile`)


def arena_in_segments(pieces: int, piece_bytes: int, whole: bool) -> ArenaWindow:
    """An arena for `pieces` pieces of the largest size, `piece_bytes`, in segments of whole pages
    of about `PAGE_LOCK_SEGMENT` bytes and at least a piece each, which hold any pieces that many
    largest ones would: one that holds at least `pieces` of them where `whole`, else at most that
    many bytes' worth."""
    segments = min(pieces, max(1, round(pieces * piece_bytes / PAGE_LOCK_SEGMENT)))
    per_segment = -(-pieces // segments) if whole else pieces // segments
    segment = paged(per_segment * piece_bytes)
    return ArenaWindow(segments * segment, segment, whole)


def arena_window(workers: int, per_rank_batch: int, piece: int, chunk: int, height: int, width: int,
                 keep_bytes: int, room: float, host_bytes: int, spill_bytes: int = 0) -> ArenaWindow | None:
    """Each worker's arena at share 1 (`arena_in_segments`): one that holds the worker's pieces of
    a whole batch where the batch fits `room` with every region at its largest; else a window of
    the batch, while pass 1 hands its chunks back, in what the pixels pass 2 needs beyond
    `keep_bytes` on the device (waiting on the host) leave of `STEP_HOST_FRACTION` of
    `host_bytes`, at most `room`, where that holds the chunks in flight; else, with `spill_bytes`
    of disk, the least window that does, and pass 2's pixels it leaves no room for on disk
    (`SpillFile`); None where nothing fits."""
    piece_bytes = aligned(piece * arena_sample_bytes(height, width))
    whole = arena_in_segments(pieces_per_worker(per_rank_batch, piece, workers), piece_bytes, whole=True)
    if workers * whole.arena_bytes <= room:
        return whole
    on_host = max(0, per_rank_batch * uint8_image_bytes(height, width) - keep_bytes)
    taken = -(-HANDED_BACK_CHUNKS * -(-chunk // piece) // max(1, workers)) + 1  # a worker's pieces in flight, at most
    least = HANDED_BACK_SPARE * (taken + 1)

    def holds(window: ArenaWindow | None) -> int:
        return window.arena_bytes // window.segment_bytes * (window.segment_bytes // piece_bytes) if window else 0

    fits = max(0, int(min(room, STEP_HOST_FRACTION * host_bytes - on_host) / max(1, workers)) // piece_bytes)
    window = arena_in_segments(fits, piece_bytes, whole=False) if fits else None
    if holds(window) >= least:
        return window._replace(on_host_bytes=on_host)
    window = arena_in_segments(least, piece_bytes, whole=True)
    in_room = max(0, int(STEP_HOST_FRACTION * host_bytes) - workers * window.arena_bytes)
    if workers * window.arena_bytes > room or on_host - in_room > spill_bytes:
        return None
    return window._replace(holds_a_batch=False, on_host_bytes=in_room, spilled_bytes=on_host - in_room)


def arenas_room() -> float:
    """The most the workers' arenas of a rank may take: `ARENA_HOST_FRACTION` of its host's memory
    (they live in memory files of their own, `SharedPages`, not in /dev/shm)."""
    return ARENA_HOST_FRACTION * host_bytes_per_rank()


def host_bytes_per_rank() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def resolve_data_path(cfg: Config, split: SplitTransform | None, device: torch.device, per_rank_batch: int,
                      flops_per_sample: int | None = None, chunk: int | None = None, keep_bytes: int = 0) -> DataPath:
    """data.decoder as this machine can run it; `flops_per_sample` (the towers' training FLOPs of a
    sample), the chunk and what the device keeps for pass 2 (`keep_bytes`) for
    data.worker_decode_share=auto."""
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
    height, width = crop.size
    chunk = chunk or min(MAX_PIECE, per_rank_batch)
    window = arena_window(cfg.data.workers, per_rank_batch, piece_size_for(per_rank_batch, chunk), chunk, height,
                          width, keep_bytes, arenas_room(), host_bytes_per_rank(), spill_room(spill_directory()))
    if share == "auto":
        # A worker's image is its crop's region (SplitTransform.crop_region): about 1.7 outputs' worth
        # on img2dataset's 256-px images, at most REGION_LIMIT; counted as two.
        share, note = auto_worker_share(cfg.data.workers, per_rank_batch, 2 * uint8_image_bytes(height, width), host_bytes_per_rank(),
                                        towers_samples_per_s(flops_per_sample, device), window is not None)
        notes += [note] if note else []
    return DataPath("device", True, notes, share, arena_window=window)


class TrainingBatches:
    """The data path of a run, built from the configuration and its plan, the world, the model's
    training transform and tokenizer, the chunk and the towers' FLOPs a sample. A part of the run's checkpoint (`state_dict`), whose
    state is read when the stream starts: load it before the first `next()`.

        with batches.next() as batch:            # at once: its pieces keep arriving
            step(batch.images, batch.texts, lr)  # Gradient Cache asks each column for its chunks
        # leaving it marks the batch used: the cursors move past it
    """

    def __init__(self, cfg: Config, plan: RunPlan, world: World, image_transform, tokenizer, chunk: int,
                 flops_per_sample: int | None = None):
        data = prepare_data(cfg.data, world)
        self.world = world
        per_rank = plan.per_rank_batch
        piece = piece_size_for(per_rank, chunk)
        split = SplitTransform.split(image_transform)
        if split is None and world.is_main:
            warnings.warn(f"the image transform {image_transform} does not split into uint8 host steps and float "
                          "device steps: loader pieces and the host batch hold float32 images (4x the memory)")
        self.path = resolve_data_path(cfg, split, world.device, per_rank, flops_per_sample, chunk, plan.keep_on_device_bytes)
        if self.path.offload and split is None:
            raise ConfigError("train.offload needs an image transform whose random crop can be kept with the image bytes "
                              f"(open_clip's RandomResizedCrop pipelines); got {image_transform}")
        self.workers = cfg.data.workers
        self.arenas = self._arenas(cfg, split, per_rank)
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
            arenas=self.arenas,
        )
        self.order = stream.order
        # A generator of its own: the loader's seed draw leaves the global RNG (dropout's) as restored.
        loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=cfg.data.workers,
                                             persistent_workers=cfg.data.workers > 0, worker_init_fn=ignore_stop_signals,
                                             multiprocessing_context=worker_context() if cfg.data.workers else None,
                                             generator=torch.Generator().manual_seed(cfg.run.seed + world.rank),
                                             **({"prefetch_factor": ARENA_BATCHES * pieces_per_worker(per_rank, piece, cfg.data.workers)} if self.arenas else {}))
        self.decoder: ImageDecoder | None = None
        if self.path.decoder == "device":
            threads = DECODE_THREADS if cfg.data.decode_workers is None else cfg.data.decode_workers
            self.decoder = DeviceDecoder(split, world.device, chunk_size=chunk, threads=0 if self.arenas else max(1, threads),
                                         arenas=self.arenas, room_ahead=self.path.arena_window.on_host_bytes if self.arenas else 0,
                                         spilled=self.path.arena_window.spilled_bytes if self.arenas else 0)
        elif self.path.offload:
            if cfg.data.decode_workers == 0:
                raise ConfigError("data.decode_workers=0 (the training thread decodes) needs data.decoder=device; with "
                                  "train.offload and the loader's decoding it is the processes decoding again: 1 or more")
            # Without workers the batch is gathered whole before the step (BatchStream's gather="whole"): no bound then.
            window = 2 * max(1, chunk // piece) if cfg.data.workers else 0
            self.decoder = DecodePool(split.decode, cfg.data.decode_workers or max(1, cfg.data.workers), window)
        self.stream = BatchStream(loader, batch_size=per_rank, piece_size=piece, state=self.state, steps=cfg.train.steps,
                                  device_transform=split.to_float if split is not None else None, decoder=self.decoder,
                                  budget=KeepBudget(plan.keep_on_device_bytes),
                                  gather="pulled" if self.arenas else "thread" if cfg.data.workers else "whole",
                                  arenas=self.arenas)

    def _arenas(self, cfg: Config, split: SplitTransform | None, per_rank: int) -> WorkerArenas | None:
        """The workers' arenas, where they write the images they decode for the device
        (`WorkerArenas`), when no thread of the trainer decodes: the workers decode every image
        (share 1), or `data.decode_workers` is 0 (the training thread decodes the GPU's JPEGs). Each
        holds its worker's pieces of a batch with every sample's crop region at its largest
        (`REGION_LIMIT` outputs' pixels: a piece's samples may all fall in the workers' share) and
        its tokens, so a batch always fits, and about two batches of img2dataset's images at share 1
        (a piece larger than that allowance, large JPEGs the GPU decodes, goes through the loader's
        queue as tensors); or, for a batch too large for that, a window of it that pass 1 hands back
        chunk by chunk (`arena_window`). None (the gathering thread copies the pixels) otherwise, or
        where even a window would take more than `ARENA_HOST_FRACTION` of the host."""
        if self.path.decoder != "device" or not cfg.data.workers or not (
                self.path.worker_decode_share >= 1 or cfg.data.decode_workers == 0):
            return None
        height, width = split.only_random_resized_crop().size
        window = self.path.arena_window
        if window is None:
            whole = per_rank * arena_sample_bytes(height, width)
            self.path.notes.append(f"the loader workers' pixels are copied by a thread of the trainer: their arenas would take "
                                   f"{whole / 2**30:.1f} GiB, over {ARENA_HOST_FRACTION:.0%} of the host's memory a rank, "
                                   "and the pixels pass 2 needs beyond data.keep_on_device_gib would leave too little of "
                                   f"{STEP_HOST_FRACTION:.0%} of it for a window of the batch, with too little room on disk "
                                   f"for the rest in {spill_directory()} ($TMPDIR; none where it is held in memory)")
            return None
        if not window.holds_a_batch:
            beyond = (f"beyond it {window.on_host_bytes / 2**30:.1f} GiB on the host and {window.spilled_bytes / 2**30:.1f} GiB "
                      f"on disk in {spill_directory()} ($TMPDIR)" if window.spilled_bytes else "beyond it on the host")
            self.path.notes.append(
                f"the loader workers' arenas hold a window of the batch ({cfg.data.workers * window.arena_bytes / 2**30:.1f} GiB): "
                "pass 1 hands each chunk back to them as it goes; what pass 2 needs again stays on the GPU "
                f"(data.keep_on_device_gib) and {beyond}")
        self.path.arenas = True
        return WorkerArenas(cfg.data.workers, window.arena_bytes, arena_sample_bytes(height, width), window.holds_a_batch,
                            window.segment_bytes)

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
        if self.arenas is not None:
            self.arenas.close()  # workers waiting for room in their arenas give up
        self.stream.close()
        if self.decoder is not None:
            self.decoder.close()


# --- a step's batch, gathered from the loader's pieces ---------------------------------------------

# A worker decodes a piece before handing it over: large pieces delay the first step and
# hold more memory in flight; small ones cost per-piece overhead (tokenizer call, IPC).
MAX_PIECE = 1024


class ImageDecoder(Protocol):
    """Who decodes the images beside the loader (decoders.DeviceDecoder, decoders.DecodePool)."""

    def column(self, batch_size: int, arrivals: Arrivals, device_transform: DeviceTransform | None,
               budget: KeepBudget | None) -> ChunkSource: ...

    def close(self) -> None: ...


@dataclass
class StreamedBatch:
    """One step's batch: its columns, filled while the step runs, and its pieces' stream records.
    Used as a context: leaving it without an error marks it used (`BatchStream.done_with`)."""

    images: ChunkSource
    texts: ChunkSource
    arrivals: Arrivals
    slot: int
    stream: "BatchStream"
    records: list = field(default_factory=list)  # (cursor, skipped, skips named, shard errors, problem shards) of each piece, in order
    handed_out_after_s: float = 0.0  # how long `BatchStream.next` waited for this batch to start
    received_ahead_s: float = 0.0  # the previous step's time receiving its pieces (counted in that step's wait)
    receiving_next_s: float = 0.0  # this step's time receiving the next batch's pieces (`BatchStream._work_ahead`)

    @property
    def data_wait_s(self) -> float:
        """Time the step waited for data: this batch's start, then each chunk not yet there (and each
        piece received, when the step's thread receives them: `PulledArrivals`), the pieces of the
        next batch the step's thread received between its chunks included, those of this batch it
        received during the previous step left out (they were that step's). Receiving blocks the
        thread that launches the step's kernels: the device runs only what was queued before."""
        return (self.handed_out_after_s + self.images.wait_s + self.texts.wait_s + self.arrivals.wait_s
                - self.received_ahead_s + self.receiving_next_s)

    def __len__(self) -> int:
        return len(self.texts)

    def __enter__(self) -> "StreamedBatch":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.stream.done_with(self, used=error is None)


class BatchStream:
    """Gathers the loader's pieces into per-step batches in a background thread, one batch ahead.

    loader:     an iterable of pieces (dicts of "images", "texts", "cursor", "skipped_samples", "skips", "problem_shards",
                "shard_errors", and "encoded" for a decoder), typically a DataLoader over `ShardStream`.
    batch_size: this rank's samples per step, a multiple of piece_size.
    state:      where the stream stands (`StreamState`, the one the loader's `ShardStream` reads
                when it starts): each used batch moves it on. It bounds the gathering, with
                `steps`, to the run's batches.
    device_transform: the device transform of the images (uint8 -> normalised float), or None
                when the pieces already hold the final images.
    decoder:    None (the pieces hold the pixels), or who decodes the images (`ImageDecoder`).
    budget:     what chunks may keep on the device for pass 2 (`KeepBudget`), or None.
    gather:     "thread": in a background thread, one batch ahead. "whole": the whole batch
                inside `next()`, when the loader decodes in this process (no workers): its
                per-sample seeding sets the process-wide RNG, which a thread would race with the
                step's dropout and Gradient Cache's replays. "pulled": each piece when a chunk
                asks for its rows, in the asking thread (`PulledArrivals`), when the workers write
                their pixels into arenas (`WorkerArenas`) and are ahead there: nothing of the
                data path runs beside the step in the training process. Where the training
                thread decodes (`DeviceDecoder` without threads) and pass 2 reads only chunks
                that pass 1 kept on the device, it begins the next batch between pass 2's chunks,
                while the device computes them: receives its pieces and decodes a share of its
                chunks each time (`_work_ahead`), so that its pass 1 finds them on the device.
    """

    SLOTS = 2  # the batch in use and the next one

    def __init__(self, loader: Iterable[dict], *, batch_size: int, piece_size: int, state: StreamState, steps: int,
                 device_transform: DeviceTransform | None = None, decoder: ImageDecoder | None = None,
                 budget: KeepBudget | None = None, gather: str = "thread", arenas: WorkerArenas | None = None):
        if batch_size % piece_size:
            raise ValueError(f"batch_size {batch_size} is not a multiple of piece_size {piece_size}")
        self.loader_iterable, self.loader = loader, None  # iterated (its workers started) by the first `next()`
        self.state, self.steps = state, steps
        self.gather = gather
        self.batch_size, self.piece_size = batch_size, piece_size
        self.device_transform = device_transform
        self.decoder = decoder
        self.budget = budget
        self.arenas = arenas  # where the workers write their pieces' tensors (`ShardStream.taken_from`)
        self.buffers: list[dict] = [{} for _ in range(self.SLOTS)]  # per slot: column name -> pinned tensor
        self.free: queue.Queue = queue.Queue()
        for slot in range(self.SLOTS):
            self.free.put(slot)
        self.ready: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.problem_shards: list[str] = []  # shards where the used batches met skipped samples or a cut (for the console)
        self.skips: list[tuple[str, str]] = []  # (where, why) of the first samples the used batches skipped (`take_skips`)
        self.thread = None
        self.upcoming: StreamedBatch | None = None  # gather="pulled": the next batch, begun by `_work_ahead`
        self.ahead_error: Exception | None = None  # what beginning it raised: raised by `next`

    def start(self) -> None:
        """Start reading: the loader's workers take the stream as it is now (a resumed run's cursors
        are in it by then, whenever they were restored), and the gathering thread starts."""
        self.loader = iter(self.loader_iterable)
        if self.arenas is not None and not self.arenas.holds_a_batch:
            self._page_lock_arenas()  # a window of them: at once (see there)
        if self.gather == "thread":
            self.thread = threading.Thread(target=on_the_callers_device(self._gather), args=(self.steps - self.state.batches,),
                                           name="clipscale-batches", daemon=True)
            self.thread.start()

    def next(self) -> StreamedBatch:
        """The next step's batch, as soon as its first piece is on its way (the first call starts reading)."""
        started = time.perf_counter()
        if self.loader is None:
            self.start()
        if self.gather == "pulled":
            if self.ahead_error is not None:
                raise self.ahead_error
            batch, self.upcoming = self.upcoming or self._pulled_batch(self.free.get_nowait()), None
        elif self.thread is None:
            gathered: list = []
            self._gather_batch(self.free.get_nowait(), gathered.append)
            batch = gathered[0]
        else:
            batch = self.ready.get()
            if isinstance(batch, UserError):
                raise type(batch)(last_line(str(batch))) from None  # a worker's, wrapped with its traceback's text
            if isinstance(batch, BaseException):
                raise RuntimeError("the data loader failed") from batch
        batch.handed_out_after_s = time.perf_counter() - started
        return batch

    def done_with(self, batch: StreamedBatch, used: bool) -> None:
        """The step is done with `batch`: when it was `used`, the stream moves past its pieces; its
        buffers take the batch after next."""
        if used:
            batch.arrivals.wait_for(len(batch))
            for record in batch.records:
                self.state.update(record)
                self.problem_shards += [shard for shard in record["problem_shards"] if shard not in self.problem_shards]
                self.skips += record.get("skips", [])[: SKIPS_NAMED - len(self.skips)]
            self.state.batches += 1
            self.state.images_trained_black += getattr(batch.images.rows, "trained_black", 0)  # a GPU decoder's rows count them
            self._page_lock_arenas()  # where no pass 2 began it (a batch of one chunk, a frozen image tower, a benchmark)
        batch.images.release()
        batch.texts.release()
        self.free.put(batch.slot)

    def take_skips(self) -> list[tuple[str, str]]:
        """(where, why) of the first `SKIPS_NAMED` samples (this rank's) that the batches used since the last call skipped."""
        skips, self.skips = self.skips, []
        return skips

    def close(self) -> None:
        """Stop gathering, release the batches gathered ahead and shut the loader's workers down
        (before the interpreter exits: a thread still inside the loader then aborts the process)."""
        self.stopping.set()
        if self.upcoming is not None:
            self.done_with(self.upcoming, used=False)
            self.upcoming = None
        self.free.put(None)  # wakes the thread if it waits for a slot
        if self.thread is not None:
            self.thread.join(timeout=10)
        while not self.ready.empty():
            batch = self.ready.get_nowait()
            if isinstance(batch, StreamedBatch):
                self.done_with(batch, used=False)
        shutdown = getattr(self.loader, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def _buffer(self, slot: int, name: str, like: torch.Tensor) -> torch.Tensor:
        """The slot's pinned buffer for a column, allocated once (pinning gigabytes takes seconds)."""
        shape = (self.batch_size, *like.shape[1:])
        buffer = self.buffers[slot].get(name)
        if buffer is None or buffer.shape != shape or buffer.dtype != like.dtype:
            buffer = pinned_empty(shape, like.dtype)
            self.buffers[slot][name] = buffer
        return buffer

    def _gather(self, batches: int) -> None:
        try:
            for _ in range(batches):
                slot = self.free.get()
                if slot is None or self.stopping.is_set():
                    return
                self._gather_batch(slot, self.ready.put)
        except BaseException as error:  # noqa: BLE001 - handed to the training thread, which raises it
            self.ready.put(error)

    def _gather_batch(self, slot: int, publish: Callable[[StreamedBatch], None]) -> None:
        """Gather one batch into `slot`, publishing it as soon as its first piece is there."""
        batch = self._start_batch(slot, self._next_piece(), Arrivals())
        publish(batch)
        try:
            for k in range(1, self.batch_size // self.piece_size):
                if self.stopping.is_set():
                    raise RuntimeError("the batch stream was closed")
                self._put(batch, k, self._next_piece())
        except BaseException as error:
            batch.arrivals.fail(error)
            raise

    def _pulled_batch(self, slot: int) -> StreamedBatch:
        """A batch whose pieces are received when its rows are asked for (`gather="pulled"`)."""
        arrivals = PulledArrivals()
        batch = self._start_batch(slot, self._next_piece(), arrivals)
        pieces = iter(range(1, self.batch_size // self.piece_size))
        arrivals.pull = lambda: self._put(batch, next(pieces), self._next_piece())
        if batch.images.ahead_shape is not None:
            batch.images.between_chunks = lambda calls_left: self._work_ahead(batch, calls_left)
        return batch

    def _work_ahead(self, in_use: StreamedBatch, calls_left: int) -> None:
        """Between two of pass 2's chunks of the batch in use, in the training thread, while the
        device computes the chunk just queued: begin the next batch (its pieces received as its
        chunks need them) and decode its share of chunks (`ChunkSource.prepare_some_ahead`). The
        pieces of the batch in use went back to the workers' arenas before pass 2 (it reads only
        kept chunks), so a worker always has room for the pieces asked for here; each of those goes
        back too once its chunk is on the device, for the batch after. The time receiving them is
        the step's data wait (`StreamedBatch.receiving_next_s`)."""
        if self.ahead_error is not None:
            return
        try:
            started = time.perf_counter()
            if self.upcoming is None:
                if self.state.batches + 1 >= self.steps:  # the batch in use is the run's last
                    return
                self.upcoming = self._pulled_batch(self.free.get_nowait())  # its first piece received
                in_use.receiving_next_s += time.perf_counter() - started
            received = self.upcoming.arrivals.wait_s
            self.upcoming.images.prepare_some_ahead(calls_left)
            self.upcoming.received_ahead_s += self.upcoming.arrivals.wait_s - received
            in_use.receiving_next_s += self.upcoming.arrivals.wait_s - received
        except Exception as error:  # noqa: BLE001 - the loader's, raised when the step that needs the batch asks for it
            self.ahead_error = error

    def _next_piece(self) -> dict:
        """The loader's next piece, its worker's error as one line (`UserError`). (A worker process
        that ended is torch's RuntimeError, raised wherever the training thread is: errors.run_main.)"""
        try:
            piece = next(self.loader)
            return piece if self.arenas is None else ShardStream.taken_from(self.arenas, piece)
        except UserError as error:
            raise type(error)(last_line(str(error))) from None

    def _start_batch(self, slot: int, piece: dict, arrivals: Arrivals) -> StreamedBatch:
        """A batch in `slot`, its columns made for `piece`, which is put in as its first."""
        if self.decoder is not None:
            images = self.decoder.column(self.batch_size, arrivals, self.device_transform, self.budget)
        else:
            images = ChunkSource(PinnedRows(self._buffer(slot, "images", piece["images"]), "images", arrivals),
                                 self.device_transform, self.budget)
        texts = ChunkSource(PinnedRows(self._buffer(slot, "texts", piece["texts"]), "texts", arrivals), budget=self.budget)
        if self.arenas is not None and self.arenas.page_locking is None:
            images.before_pass_2 = texts.before_pass_2 = self._page_lock_arenas
        batch = StreamedBatch(images, texts, arrivals, slot, self)
        try:
            self._put(batch, 0, piece)
        except BaseException as error:
            arrivals.fail(error)
            raise
        return batch

    def _put(self, batch: StreamedBatch, k: int, piece: dict) -> None:
        """Piece `k` of the batch into its columns and records."""
        rows = slice(k * self.piece_size, (k + 1) * self.piece_size)
        if len(piece["texts"]) != self.piece_size:
            raise RuntimeError(f"a loader piece has {len(piece['texts'])} samples, expected {self.piece_size}")
        batch.images.put(rows, piece)
        batch.texts.put(rows, piece)
        batch.records.append({key: piece[key] for key in ("cursor", "drawn", "sample_keys", "skipped_samples", "skips",
                                                           "shard_errors", "captions_cut", "problem_shards")
                              if key in piece})
        batch.arrivals.add(self.piece_size)

    def _page_lock_arenas(self) -> None:
        """Page-lock the workers' arenas (`WorkerArenas.page_lock_in_background`) once the first
        batch's pass 1 is over: as its pass 2 begins (in a first step, while the backward graphs
        compile) or as the step is done with it. Every CUDA call of the process waits behind each
        registration, so pass 1's copies of the first batch, its first decoded images, never do.
        A window of the arenas (a batch larger than they hold) is page-locked as reading starts,
        while the first step compiles: pass 1 goes round it several times a batch, and until it is
        page-locked the training thread stages every chunk's regions through pinned memory of its
        own, a host copy of about twice the batch's pixels (at 524,288 on one H200, py-spy caught it
        staging in 2 of 9 dumps of the first step), where registering the window costs its size once."""
        if self.arenas is not None and self.arenas.page_locking is None:
            self.arenas.page_lock_in_background()


def last_line(message: str) -> str:
    """A loader worker's error as the DataLoader re-raises it ("Caught X in DataLoader worker
    process 0. Original Traceback ... X: message"): the message alone."""
    last = message.rstrip().splitlines()[-1] if message.strip() else message
    return last.split(": ", 1)[1] if "Original Traceback" in message and ": " in last else message


def piece_size_for(batch_size: int, chunk_size: int) -> int:
    """The loader's piece: the largest size up to MAX_PIECE that tiles both this rank's batch
    and its chunks, so a chunk is ready as soon as its own pieces are (a batch of 65,536 in
    chunks of 512 comes in pieces of 512; 1,000 in chunks of 512 in pieces of 8)."""
    return math.gcd(batch_size, min(chunk_size, MAX_PIECE, batch_size))
