"""What `data.decoder` resolves to on a machine (clipscale/data/pipeline.py)."""

from __future__ import annotations

import pytest
import torch
from open_clip.transform import image_transform

from clipscale.config import ConfigError, load_config
from clipscale.data.pipeline import auto_worker_share, resolve_data_path
from clipscale.data.transforms import SplitTransform

SPLIT = SplitTransform.split(image_transform(224, is_train=True))


def resolve(*overrides, device="cuda", split=SPLIT, per_rank_batch=512):
    return resolve_data_path(load_config("configs/vit_b16_infcl.yaml", list(overrides)), split, torch.device(device),
                             per_rank_batch)


def test_auto_decodes_in_the_loader_on_a_cpu_and_on_the_device_on_a_gpu():
    path = resolve(device="cpu")
    assert (path.decoder, path.offload, path.notes) == ("loader", False, [])
    path = resolve()  # a GPU device: nothing here touches it
    assert (path.decoder, path.offload, path.notes) == ("device", True, [])
    assert "nvJPEG" in path.describe()


def test_a_worker_share_says_what_it_does_where_it_does_something():
    path = resolve("data.worker_decode_share=0.3")
    assert path.notes == [] and "30% of its JPEGs by the loader workers" in path.describe()
    path = resolve("data.worker_decode_share=0.3", device="cpu")
    assert path.worker_decode_share == 0.0 and "data.worker_decode_share=0.3 does nothing here" in path.notes[0]


def test_the_run_says_whether_the_workers_arenas_are_page_locked(monkeypatch):
    """A benchmark's CLIPSCALE_PAGE_LOCK_ARENAS=0 leaves the arenas pageable: the console says so."""
    from clipscale.data.pipeline import DataPath

    arenas = DataPath("device", True, [], worker_decode_share=1.0, arenas=True)
    assert "into page-locked shared memory" in arenas.describe()
    monkeypatch.setenv("CLIPSCALE_PAGE_LOCK_ARENAS", "0")
    assert "into pageable shared memory (CLIPSCALE_PAGE_LOCK_ARENAS=0)" in arenas.describe()


def test_the_auto_share_follows_the_workers_and_stays_off_where_the_pixels_would_fill_the_host():
    pixels, host = 3 * 224 * 224, 128 * 2**30
    assert auto_worker_share(14, 32768, pixels, host) == (0.4, None)
    assert auto_worker_share(28, 32768, pixels, host) == (0.4, None)  # more workers than measured: no more
    assert auto_worker_share(7, 32768, pixels, host) == (0.2, None)
    share, note = auto_worker_share(14, 1048576, pixels, host)  # a million samples: 176 GiB of pixels at 0.4
    assert share == 0.0 and "176 GiB of the host's 128 GiB" in note
    assert auto_worker_share(0, 32768, pixels, host) == (0.0, None)  # no workers: the GPU decodes it all
    path = resolve("data.workers=14", per_rank_batch=64)
    assert path.worker_decode_share == 0.4 and path.notes == [] and "40% of its JPEGs" in path.describe()
    path = resolve("data.workers=14", per_rank_batch=2**40)
    assert path.worker_decode_share == 0.0 and "data.worker_decode_share=auto: 0" in path.notes[0]
    assert resolve("data.workers=14", device="cpu").notes == []  # auto says nothing where the loader decodes


def test_the_auto_share_gives_the_workers_every_image_where_they_outpace_the_towers(monkeypatch):
    """Share 1 (the workers' arenas) where the workers decode faster than the towers train: 14 of
    them for ViT-B/16's 103 GFLOP a sample on an H200 (about 2,100 samples/s estimated) and ViT-B/32's
    28 (about 7,800), not 11 for ViT-B/32 nor 3 for ViT-B/16; where the arenas would not fit their
    room, the measured share, and 0 where its pixels would not fit the host."""
    import clipscale.data.pipeline as pipeline

    pixels, host = 2 * 3 * 224 * 224, 128 * 2**30
    room = 0.5 * host  # ARENA_HOST_FRACTION of the host
    kept = 35 * 2**30  # a quarter of an H200
    monkeypatch.setattr(pipeline, "peak_bf16_flops", lambda device: 989e12)
    b16, b32 = (pipeline.towers_samples_per_s(flops, torch.device("cuda")) for flops in (103e9, 28e9))
    assert 2000 < b16 < 2200 and 7700 < b32 < 7900

    def share(workers, batch, towers):
        window = pipeline.arena_window(workers, batch, 512, 512, 224, 224, kept, room, host)
        return auto_worker_share(workers, batch, pixels, host, towers, window is not None)

    assert share(14, 32768, b16) == (1.0, None)
    assert share(14, 32768, b32) == (1.0, None)
    assert share(11, 32768, b32)[0] == pytest.approx(0.4 * 11 / 14)  # 8,580 images/s: not enough
    assert share(3, 32768, b16)[0] == pytest.approx(0.4 * 3 / 14)  # 2,340 images/s
    assert share(14, 65536, b32) == (1.0, None)  # the arenas take 40 GiB of the 64 they may
    assert share(14, 262144, b32) == (1.0, None)  # a window of the batch; 2 GiB of pass 2's pixels beyond the GPU's 35
    assert share(14, 1048576, b32)[0] == 0.0  # 112 GiB beyond the GPU: no room for a window; at 0.4 too
    assert share(14, 32768, None) == (0.4, None)  # no GPU peak known


def test_a_batch_larger_than_its_arenas_takes_a_window_of_them_while_pass_twos_pixels_fit():
    """Share 1's arenas (`arena_window`) on a 128 GiB host a GPU, a quarter of an H200 kept for pass 2:
    whole up to the 64 GiB they may take (ViT-B/32's 65,536: 40 GiB); a window of 64 GiB beyond
    (131,072 and 262,144 a GPU, where the pixels pass 2 needs beyond the GPU's 35 GiB fit beside
    it in three quarters of the host); none at a million with a quarter of the GPU kept (112 GiB
    beyond it), but a window in what those pixels leave of three quarters of the host where the
    GPU keeps more; none where the room is too small for a worker's pieces in flight. A window
    says what waits on the host for pass 2 (the room made ahead); whole arenas, nothing."""
    from clipscale.data.pipeline import STEP_HOST_FRACTION, arena_sample_bytes, arena_window

    gib, sample = 2**30, arena_sample_bytes(224, 224)
    host, room, kept = 128 * gib, 64 * gib, 35 * gib
    piece = 512 * sample  # the largest: every region at REGION_LIMIT, whole pages (147 a region, 2 the tokens)
    arena, segment, whole, on_host, _ = arena_window(14, 65536, 512, 512, 224, 224, kept, room, host)
    assert whole and on_host == 0 and segment == piece and arena == 10 * piece and 14 * arena < 41 * gib  # 128 pieces: at most 10 a worker
    for batch in (131072, 262144):
        arena, segment, whole, on_host, _ = arena_window(14, batch, 512, 512, 224, 224, kept, room, host)
        assert on_host == max(0, batch * 3 * 224 * 224 - kept)
        assert not whole and arena % segment == 0 and room - 14 * segment < 14 * arena <= room
    assert arena_window(14, 1048576, 512, 512, 224, 224, kept, room, host) is None
    assert arena_window(14, 262144, 512, 512, 224, 224, kept, room, 4 * gib) is None  # 2 GiB of 3: no room for a window
    for kept_gib in (80, 100):  # a million, most of pass 2's pixels on the GPU: a window in what the rest leaves
        on_host = 1048576 * 3 * 224 * 224 - kept_gib * gib
        arena, segment, whole, on_host_bytes, _ = arena_window(14, 1048576, 512, 512, 224, 224, kept_gib * gib, room, host)
        assert on_host_bytes == on_host
        assert not whole and STEP_HOST_FRACTION * host - on_host - 14 * segment < 14 * arena <= STEP_HOST_FRACTION * host - on_host
    # A worker's window holds twice its pieces in flight (6 chunks' pieces over 14 workers, one more) and its next
    least = 2 * ((1 + 1) + 1) * piece
    assert arena_window(14, 262144, 512, 512, 224, 224, kept, 14 * least, host)[:3] == (least, piece, False)
    assert arena_window(14, 262144, 512, 512, 224, 224, kept, 14 * least - 14 * 8, host) is None
    # Small pieces share a segment of about PAGE_LOCK_SEGMENT bytes: an arena of whole segments
    arena, segment, whole, _, _ = arena_window(14, 4096, 64, 512, 224, 224, kept, room, host)
    assert whole and segment == arena == 5 * 64 * sample  # 5 pieces of 64 a worker: one segment


def test_a_million_on_an_80_gb_gpu_takes_the_least_window_and_spills_what_the_host_cannot_hold():
    """ViT-B/32's million on one H100 (a quarter of its 80 GB kept for pass 2, a 128 GiB host): no
    window without a disk, as before; with one, the least window that holds the chunks in flight,
    the host's room in what it leaves of three quarters of the host, and the rest of pass 2's
    pixels on disk, not more than the disk's room; where the host holds pass 2's pixels, nothing
    spills even with a disk."""
    from clipscale.data.pipeline import STEP_HOST_FRACTION, arena_sample_bytes, arena_window

    gib, piece = 2**30, 512 * arena_sample_bytes(224, 224)
    host, room, kept = 128 * gib, 64 * gib, 20 * gib
    beyond = 1048576 * 3 * 224 * 224 - kept
    assert arena_window(14, 1048576, 512, 512, 224, 224, kept, room, host) is None
    window = arena_window(14, 1048576, 512, 512, 224, 224, kept, room, host, 200 * gib)
    least = 2 * ((1 + 1) + 1)  # pieces: twice a worker's in flight (6 chunks' over 14 workers, one more) and its next
    assert not window.holds_a_batch and window.arena_bytes // piece == least, window
    assert window.on_host_bytes + 14 * window.arena_bytes == int(STEP_HOST_FRACTION * host)
    assert window.on_host_bytes + window.spilled_bytes == beyond and window.spilled_bytes > 40 * gib
    assert arena_window(14, 1048576, 512, 512, 224, 224, kept, room, host, window.spilled_bytes - 1) is None
    assert arena_window(14, 262144, 512, 512, 224, 224, 35 * gib, room, host, 200 * gib).spilled_bytes == 0


def test_vit_b32_on_an_h200_host_with_14_workers_takes_share_one_at_the_shipped_defaults(monkeypatch):
    """The FLOPs the trainer hands the data path (a sample in the shortest text bucket, counted on
    the real towers by the function trainer.py calls) give ViT-B/32 share 1 at 32,768 and 65,536 a GPU on
    a 128 GiB host, where it was measured best (0.967 of its ceiling against 0.833 at 0.4): an
    estimate of the towers' speed at ViT-B/16's mfu left it at 0.4."""
    import clipscale.data.pipeline as pipeline
    from clipscale.caption_length import text_lengths_for_run
    from clipscale.models import build_model
    from clipscale.utilization import train_flops_by_text_length

    cfg = load_config("configs/vit_b16_infcl.yaml", ["model.name=ViT-B-32", "data.workers=14"])
    towers = build_model(cfg.model, compiled=False)
    text_order, _ = text_lengths_for_run(towers.model, cfg.model.cut_text_padding, cfg.model.causal_text_attention)
    flops = min(train_flops_by_text_length(towers.model, 224, text_order, torch.device("cpu")).values())
    monkeypatch.setattr(pipeline, "peak_bf16_flops", lambda device: 989e12)  # an H200's
    monkeypatch.setattr(pipeline, "host_bytes_per_rank", lambda: 128 * 2**30)
    monkeypatch.setattr(pipeline, "arenas_room", lambda: 64 * 2**30)
    for batch in (32768, 65536):
        path = resolve_data_path(cfg, SPLIT, torch.device("cuda"), batch, flops_per_sample=flops)
        assert path.worker_decode_share == 1.0 and path.notes == [], (batch, flops, path.notes)


def test_a_transform_the_device_cannot_run_stays_in_the_loader_saying_so():
    path = resolve(split=None)
    assert path.decoder == "loader" and "data.decoder=auto" in path.notes[0]
    with pytest.raises(ConfigError, match="data.decoder=device needs"):
        resolve("data.decoder=device", split=None)


def test_a_stream_takes_its_state_when_it_starts_reading_not_when_it_is_built(digits_root):
    """No call order between restoring a checkpoint and building the data path: a stream built
    before its state is restored resumes where the state says, as one built after it."""
    from clipscale.data.digits import write_digits_shards
    from clipscale.data.shards import ShardStream, StreamState

    shards = [str(digits_root / name) for name in write_digits_shards(digits_root, image_size=32)["train_shards"]]
    transform = image_transform(32, is_train=True)

    def stream(state):
        return ShardStream(shards, piece_size=10, rank=0, world_size=1, num_workers=1, seed=0, image_transform=transform,
                           tokenizer=lambda captions: torch.tensor([len(c) for c in captions]), shuffle_buffer=20,
                           state=state)

    uninterrupted = iter(stream(None))
    consumed = StreamState()
    for _ in range(3):
        consumed.update(next(uninterrupted))
    restored_later = StreamState()
    built_first = stream(restored_later)
    restored_later.load_state_dict(consumed.state_dict())
    got, want = next(iter(built_first)), next(uninterrupted)
    assert got["cursor"] == want["cursor"] and torch.equal(got["images"], want["images"])
