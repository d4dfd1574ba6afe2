"""Training data the way users have it: img2dataset shards with metadata, own keys, several
sources with upsampling factors, resampled shards, a CSV table, shards served over HTTP, and a
resume that seeks instead of reading the epoch again. All on data the tests write."""

from __future__ import annotations

import functools
import http.server
import os
import pathlib
import shutil
import subprocess
import sys
import threading
from collections import Counter
from itertools import islice

import pytest
import torch
import torchvision.transforms as T

from clipscale.config import ConfigError, DataConfig, load_config
from clipscale.data import prepare_data
from clipscale.data.shards import ShardStream, StreamState
from clipscale.errors import UserError
from clipscale.data.sources import IMAGE_KEYS, TEXT_KEYS, keys
from clipscale.distributed import World
from clipscale.metrics import read_metrics

from tests.helpers.tiny_runs import DIGITS_YAML, REPO
from tests.helpers.user_data import noise_image, write_csv, write_img2dataset_shards

CROP = T.Compose([T.RandomResizedCrop(16, scale=(0.3, 1.0)), T.ToTensor()])


def config(*overrides):
    return load_config(DIGITS_YAML, list(overrides))


def stream_of(cfg, state=None, piece_size=8, workers=1, seed=7, image_transform=CROP):
    source = prepare_data(cfg.data, World()).train_shards
    return ShardStream(source, piece_size=piece_size, rank=0, world_size=1, num_workers=workers, seed=seed,
                       image_transform=image_transform, tokenizer=list, shuffle_buffer=cfg.data.shuffle_buffer, state=state)


def captions(stream, pieces):
    return [c for piece in islice(iter(stream), pieces) for c in piece["texts"]]


def test_img2dataset_shards_give_their_txt_captions_not_the_json_metadata(tmp_path):
    pattern = write_img2dataset_shards(tmp_path / "shards", shards=3, per_shard=8)
    seen = captions(stream_of(config("data.kind=webdataset", f"data.train_shards={pattern}")), 3)
    assert sorted(seen) == sorted(f"caption {i}" for i in range(24))


def test_the_configured_default_keys_are_the_stream_defaults():
    defaults = DataConfig()
    assert (keys(defaults.image_key), keys(defaults.caption_key)) == (IMAGE_KEYS, TEXT_KEYS)


def test_image_and_caption_keys_are_configurable(tmp_path):
    pattern = write_img2dataset_shards(tmp_path / "shards", shards=2, per_shard=8, image_key="picture.png",
                                       caption_key="alt")
    default = stream_of(config("data.kind=webdataset", f"data.train_shards={pattern}"))
    with pytest.raises(UserError, match="decoded no sample"):  # neither key is a default one
        next(iter(default))
    own = config("data.kind=webdataset", f"data.train_shards={pattern}", "data.image_key=picture.png",
                 "data.caption_key=title;alt")
    assert sorted(captions(stream_of(own), 2)) == sorted(f"caption {i}" for i in range(16))


def test_two_sources_are_drawn_by_their_upsampling_factors(tmp_path):
    """Equal sources, factors 1 and 3: a quarter of the samples from the first. 600 shard draws
    of 5 samples: the share's standard error is 0.018; the test allows 4 of them."""
    a = write_img2dataset_shards(tmp_path / "a", shards=4, per_shard=5, prefix="a ")
    b = write_img2dataset_shards(tmp_path / "b", shards=4, per_shard=5, prefix="b ")
    assert_drawn_by_factors("webdataset", f"{a}::{b}")


def assert_drawn_by_factors(kind: str, sources: str) -> None:
    """Two sources whose captions start "a " and "b ", resampled: with factors 1::3 a quarter of 100
    pieces of 30 samples come from the first, with 1::1 a half."""
    shares = {}
    for factors in ("1::3", "1::1"):
        cfg = config(f"data.kind={kind}", f"data.train_shards={sources}", "data.resampled=true",
                     f"data.upsampling_factors={factors}", "data.shuffle_buffer=10")
        seen = captions(stream_of(cfg, piece_size=30), 100)
        shares[factors] = sum(c.startswith("a ") for c in seen) / len(seen)
    assert abs(shares["1::3"] - 0.25) < 4 * 0.018, shares
    assert abs(shares["1::1"] - 0.5) < 4 * 0.021, shares


def test_resampled_shards_are_drawn_with_replacement_and_resume_exactly(tmp_path):
    pattern = write_img2dataset_shards(tmp_path / "shards", shards=6, per_shard=4)
    cfg = config("data.kind=webdataset", f"data.train_shards={pattern}", "data.resampled=true", "data.shuffle_buffer=6")
    uninterrupted = list(islice(iter(stream_of(cfg, piece_size=4)), 30))
    # Epoch 0 (6 draws of 6 shards): samples of one shard twice, of some shard never, as with replacement.
    first_epoch = Counter(c for piece in uninterrupted[:6] for c in piece["texts"])
    assert max(first_epoch.values()) > 1 and len(first_epoch) < 24
    _assert_resumes_exactly(lambda state: stream_of(cfg, state, piece_size=4), uninterrupted, stop=17)


def test_a_resume_with_fewer_shards_than_loader_workers_is_exact(tmp_path):
    """Each of 3 workers keeps every 3rd sample of the 2 shards: a resume seeks by member index."""
    pattern = write_img2dataset_shards(tmp_path / "shards", shards=2, per_shard=20)
    cfg = config("data.kind=webdataset", f"data.train_shards={pattern}", "data.shuffle_buffer=5")

    def loader(state):
        stream = stream_of(cfg, state, piece_size=3, workers=3)
        return torch.utils.data.DataLoader(stream, batch_size=None, num_workers=3)

    uninterrupted = list(islice(iter(loader(None)), 40))  # 3 epochs
    _assert_resumes_exactly(loader, uninterrupted, stop=22)


def _assert_resumes_exactly(make_stream, uninterrupted, stop):
    state = StreamState()
    for piece in uninterrupted[:stop]:
        state.update(piece)
    resumed = list(islice(iter(make_stream(state)), len(uninterrupted) - stop))
    for a, b in zip(uninterrupted[stop:], resumed, strict=True):
        assert a["cursor"] == b["cursor"]
        assert a["texts"] == b["texts"]
        assert torch.equal(a["images"], b["images"])
        assert a["skipped_samples"] == b["skipped_samples"]


def test_a_csv_table_trains_like_shards_and_resumes_exactly(tmp_path, monkeypatch):
    table = write_csv(tmp_path, rows=62, missing={3, 10})  # 60 usable: 10 pieces an epoch
    monkeypatch.chdir(tmp_path / "images")  # paths are relative to the CSV's folder, not to the working one
    cfg = config("data.kind=csv", f"data.train_shards={table}", "data.shuffle_buffer=12")
    uninterrupted = list(islice(iter(stream_of(cfg, piece_size=6)), 25))  # 2.5 epochs
    first_epoch = [c for piece in uninterrupted[:10] for c in piece["texts"]]
    assert sorted(first_epoch) == sorted(f"a csv caption {i}" for i in range(62) if i not in {3, 10})
    assert sum(piece["skipped_samples"] for piece in uninterrupted[:10]) == 2  # the two missing image files
    _assert_resumes_exactly(lambda state: stream_of(cfg, state, piece_size=6), uninterrupted, stop=13)


def test_a_csv_tables_image_files_are_read_once_an_epoch(tmp_path, monkeypatch):
    """A table of fewer than 1,000 rows is one block, cut into 64 parts (each part every 64th row,
    read by its own pass over the block): each part opens its own rows' files only, not the whole
    table's, 64 times an epoch."""
    table = write_csv(tmp_path, rows=62, missing={3, 10})
    monkeypatch.chdir(tmp_path / "images")
    cfg = config("data.kind=csv", f"data.train_shards={table}", "data.shuffle_buffer=12")
    opened = Counter()
    read_bytes = pathlib.Path.read_bytes

    def counted(path):
        opened[str(path)] += 1
        return read_bytes(path)

    monkeypatch.setattr(pathlib.Path, "read_bytes", counted)
    epoch = list(islice(iter(stream_of(cfg, piece_size=6)), 10))  # 60 usable rows: one epoch
    assert sum(piece["skipped_samples"] for piece in epoch) == 2
    assert len(opened) == 62 and max(opened.values()) == 1, opened.most_common(3)


def test_csv_sources_are_drawn_by_their_upsampling_factors(tmp_path):
    """As shards are (above): two CSV tables, each one block of 5 rows, factors 1 and 3 (resampled):
    a quarter of the samples from the first; 600 block draws, the share's standard error 0.018."""
    tables = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "0.png").write_bytes(noise_image(0, "PNG"))
        tables.append(tmp_path / name / "train.csv")
        tables[-1].write_text("filepath\ttitle\n" + "".join(f"0.png\t{name} row {i}\n" for i in range(5)))
    assert_drawn_by_factors("csv", f"{tables[0]}::{tables[1]}")


def test_csv_columns_and_separator_are_configurable_and_checked(tmp_path):
    table = write_csv(tmp_path, rows=10, separator=",", image_column="path", caption_column="text")
    with pytest.raises(ConfigError, match="data.train_shards: .* has no column 'filepath'"):
        prepare_data(config("data.kind=csv", f"data.train_shards={table}").data, World())
    cfg = config("data.kind=csv", f"data.train_shards={table}", 'data.csv_separator=","', "data.csv_image_key=path",
                 "data.csv_caption_key=text")
    assert sorted(captions(stream_of(cfg, piece_size=5), 2)) == sorted(f"a csv caption {i}" for i in range(10))


def test_data_image_size_is_refused_where_the_model_decides_the_size(tmp_path):
    with pytest.raises(ConfigError, match="data.image_size: only for data.kind=digits"):
        config("data.kind=webdataset", "data.train_shards=x.tar", "data.image_size=224")
    assert config().data.image_size is None  # digits draw at 32 unless told


def test_shards_given_to_a_digits_run_are_refused_not_ignored():
    """The digits config with data.train_shards=... would otherwise train on the digits, saying nothing."""
    with pytest.raises(ConfigError, match="data.train_shards: data.kind is 'digits'.*add data.kind=webdataset"):
        config("data.train_shards=myshards")


@pytest.fixture
def http_root(tmp_path):
    """An HTTP server on 127.0.0.1 serving tmp_path/served; yields (folder, base URL)."""
    served = tmp_path / "served"
    served.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield served, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


@pytest.mark.skipif(shutil.which("curl") is None, reason="webdataset opens http(s) shards with curl")
def test_shards_served_over_http_read_as_local_ones(http_root):
    served, url = http_root
    write_img2dataset_shards(served, shards=3, per_shard=8)
    local = config("data.kind=webdataset", f"data.train_shards={served}/{{00000..00002}}.tar")
    remote = config("data.kind=webdataset", f"data.train_shards={url}/{{00000..00002}}.tar")
    assert captions(stream_of(remote), 6) == captions(stream_of(local), 6)
    piped = config("data.kind=webdataset", f"data.train_shards=pipe:cat {served}/{{00000..00002}}.tar")
    assert captions(stream_of(piped), 6) == captions(stream_of(local), 6)
    with pytest.raises(ConfigError, match="data.train_shards: .* matches no file"):
        prepare_data(config("data.kind=webdataset", f"data.train_shards={served}/missing-{{0..2}}.tar").data, World())
    # A URL that does not answer: counted as a shard error, not a stop (local files are checked at the start).
    gone = config("data.kind=webdataset", f"data.train_shards={url}/{{00000..00003}}.tar")
    pieces = list(islice(iter(stream_of(gone)), 5))
    assert sorted(c for piece in pieces[:3] for c in piece["texts"]) == sorted(f"caption {i}" for i in range(24))
    assert sum(piece["shard_errors"] for piece in pieces) >= 1


# --- resume without re-reading ------------------------------------------------------------------

SHARDS, PER_SHARD, BUFFER, PIECE = 200, 10, 50, 50


def test_a_resume_at_90_percent_of_an_epoch_seeks_instead_of_reading_the_epoch(tmp_path):
    """Counted, not timed: the shards the resumed reader opens and the images it decodes for its
    first piece are those a fresh start needs for its own (the buffer's and the piece's), not the
    90% of the epoch before the cursor."""
    pattern = write_img2dataset_shards(tmp_path / "shards", shards=SHARDS, per_shard=PER_SHARD)
    cfg = config("data.kind=webdataset", f"data.train_shards={pattern}", f"data.shuffle_buffer={BUFFER}")
    opened, decoded = [], []

    def counting_crop(image):
        decoded.append(1)
        return CROP(image)

    def make_stream(state):
        stream = stream_of(cfg, state, piece_size=PIECE, image_transform=counting_crop)
        slot_of = stream.shuffled_slot
        stream.shuffled_slot = lambda *args: opened.append(slot_of(*args)) or opened[-1]
        return stream

    def first_piece(state) -> tuple[dict, int, int]:
        """A new reader's first piece, the shards it opened and the images it decoded for it."""
        opened.clear()
        decoded.clear()
        piece = next(iter(make_stream(state)))
        return piece, sum(slot.opened for slot in opened), len(decoded)

    stop = SHARDS * PER_SHARD * 9 // 10 // PIECE  # pieces before the cursor: 90% of the epoch
    uninterrupted = list(islice(iter(make_stream(None)), stop + 3))
    state = StreamState()
    for piece in uninterrupted[:stop]:
        state.update(piece)

    _, fresh_shards, fresh_decoded = first_piece(None)
    first, resumed_shards, resumed_decoded = first_piece(state)
    assert first["cursor"] == uninterrupted[stop]["cursor"]
    assert first["texts"] == uninterrupted[stop]["texts"] and torch.equal(first["images"], uninterrupted[stop]["images"])
    _assert_resumes_exactly(make_stream, uninterrupted, stop)
    print(f"\nfirst piece: fresh {fresh_shards} shards opened, {fresh_decoded} images decoded; resumed at 90%: "
          f"{resumed_shards} and {resumed_decoded} (the epoch before the cursor: {stop * PIECE // PER_SHARD} shards)")
    # The shards the resumed reader opened: those holding the buffer's samples and the current one.
    assert resumed_shards < 60, "a resumed stream read shards that hold nothing it needs"
    # Only the piece's images are decoded, as on a fresh start: a seek does not decode what it skips.
    assert resumed_decoded == fresh_decoded == PIECE


# --- the own-data page, run as written --------------------------------------------------------

def _page_command(heading: str) -> str:
    """The first bash block under `heading` in docs/own_data.md, its continued lines joined."""
    page = (REPO / "docs" / "own_data.md").read_text()
    block = page.split(heading, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return block.replace("\\\n", " ")


@pytest.mark.slow
def test_the_own_data_page_check_command_trains_and_validates_on_the_example_config(tmp_path):
    """From a clone's root (train.py and configs/ beside data/), on a user's one source of shards and
    validation set in img2dataset's layout, at the command's paths: the example's two upsampling
    factors do not stand in the way."""
    for name in ("train.py", "configs", "clipscale"):
        (tmp_path / name).symlink_to(REPO / name)
    write_img2dataset_shards(tmp_path / "data" / "mine", shards=10, per_shard=2, prefix="mine ")
    write_img2dataset_shards(tmp_path / "data" / "mine-val", shards=2, per_shard=8, prefix="held out ")
    command = _page_command("## Check your data first")
    assert command.startswith("python train.py --config configs/webdataset_example.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    result = subprocess.run(["bash", "-c", command.replace("python ", f"{sys.executable} ", 1)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2: val_loss" in result.stdout + result.stderr
    metrics = read_metrics(tmp_path / "runs" / "check-my-data" / "metrics.jsonl")
    assert [m["step"] for m in metrics if "val_loss" in m] == [2]
    assert [m["skipped_samples_total"] for m in metrics if "loss" in m][-1] == 0
    assert "check-my-data: step 2/2 (100%)" in result.stderr, result.stderr[-3000:]  # the progress, plain in a log
